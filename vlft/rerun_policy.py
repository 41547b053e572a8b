"""The workflow's rerun policy, applied to Snakemake's settings by the workflow itself, so that a study
run as a deployed module (whose directory has no profiles/default) reruns exactly what a clone does."""

from __future__ import annotations

from snakemake.settings.enums import RerunTrigger

# Inputs' content (mtime, then checksums), params and the set of inputs; not the code or the
# software environment: a release changes a rule's command line or the library to change how a job
# runs, and a study in progress keeps what it computed (a release that changes a result says so in
# CHANGELOG.md and reruns it through its params).
TRIGGERS = frozenset({RerunTrigger.MTIME, RerunTrigger.PARAMS, RerunTrigger.INPUT})
# Inputs up to this size are compared by content: prepared splits of tens of thousands of records
# are larger than Snakemake's 1 MB default.
MAX_CHECKSUM_FILE_SIZE = 1_000_000_000


def apply_when_planned(workflow) -> None:
    """Apply `rerun_policy` to the settings `workflow`'s plan is made with. They exist only after the
    Snakefile has been read (Snakemake's DAG API sets them then), so the workflow's every way to a
    plan, `_prepare_dag` (run, dry run, --summary, --dag), applies the policy first. Snakemake offers
    no setting of its own for this from inside a workflow."""
    prepare = workflow._prepare_dag

    def prepared(*args, **kwargs):
        rerun_policy(workflow.dag_settings)
        return prepare(*args, **kwargs)

    workflow._prepare_dag = prepared


def rerun_policy(dag_settings) -> None:
    """Narrow Snakemake's rerun triggers to TRIGGERS and compare inputs by content up to
    MAX_CHECKSUM_FILE_SIZE, each where it is at Snakemake's default (a command line or profile that
    set its own keeps it); and redo what a crashed driver left unfinished."""
    if set(dag_settings.rerun_triggers) == set(RerunTrigger.all()):
        dag_settings.rerun_triggers = TRIGGERS
    if dag_settings.max_checksum_file_size == type(dag_settings)().max_checksum_file_size:
        dag_settings.max_checksum_file_size = MAX_CHECKSUM_FILE_SIZE
    dag_settings.force_incomplete = True
