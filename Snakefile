# Vision-language LoRA fine-tuning experiments: caches -> training stages -> evaluations -> report.
from snakemake.utils import min_version

import os
import sys

from vlft.jobs.driver import set_up_driver

min_version("9.0")


report: "workflow/report/workflow.rst"


# The demo, unless a config file is given: a user's --configfile is the whole config, never merged
# into the demo's. It is checked against workflow/schemas/config.schema.yaml, and keys it leaves out
# take the defaults documented there (workflow/rules/common.smk, through vlft.config).
if not workflow.overwrite_configfiles:

    configfile: os.path.join(workflow.current_basedir.get_path_or_uri(True), "config/config.yaml")


include: "workflow/rules/common.smk"


# The driver's own process: signals, Ctrl-C to its jobs, what its jobs inherit (vlft.jobs.driver).
set_up_driver(workflow, RESULTS)


include: "workflow/rules/prepare.smk"
include: "workflow/rules/cache.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/export.smk"


if "demo" in config:

    include: "workflow/rules/demo.smk"


onstart:
    # Said first, so that a study's outputs are never looked for in another's directory.
    print(f"Results of this study: {RESULTS}/", file=sys.stderr)


onsuccess:
    # Said last: who won each split, and where the report is (vlft.report loads matplotlib: here only).
    from vlft.report import outcome_lines

    for line in outcome_lines(report_path("")):
        print(line, file=sys.stderr)


rule all:
    default_target: True
    input:
        report_path("index.html"),
        # Outputs removed as damaged, until they are made again (vlft.empty_outputs).
        outputs_to_remake(),
