"""Write the comparative report: results/report/index.html and its CSV tables."""

import argparse

from vlft.cli import run
from vlft.report import write_report


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--metrics", nargs="+", required=True)
    parser.add_argument("--summaries", nargs="+", required=True)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()
    write_report(args.metrics, args.summaries, args.output_dir)
    print(f"wrote {args.output_dir}/index.html")


if __name__ == "__main__":
    run(main)
