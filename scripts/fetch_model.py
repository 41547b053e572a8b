"""Fetch the config's `model.hub_id` from the Hugging Face Hub (a local rule: it runs where the driver
runs, where the network is, never in a GPU job), into Hugging Face's cache, linked as `model.path`."""

import argparse

from vlft.jobs.cli import run
from vlft.model_files import fetch_model


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hub-id", required=True)
    parser.add_argument("--revision", help="a branch, tag or commit; main where not given")
    parser.add_argument("--output", required=True, help="the link the study's jobs read the model from")
    args = parser.parse_args()
    snapshot = fetch_model(args.hub_id, args.revision, args.output)
    print(f"{args.hub_id}: {snapshot}, linked as {args.output}")


if __name__ == "__main__":
    run(main)
