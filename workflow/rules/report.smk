rule report:
    # One self-contained HTML page with every experiment x stage beside the base model, plus CSV tables.
    input:
        unpack(get_report_inputs),
    output:
        html=f"{RESULTS}/report/index.html",
        results=f"{RESULTS}/report/results.csv",
        categories=f"{RESULTS}/report/accuracy_by_category.csv",
        jobs=f"{RESULTS}/report/jobs.csv",
    log:
        f"{RESULTS}/logs/report.log",
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "python scripts/report.py --metrics {input.metrics:q} "
        "--summaries {input.summaries:q} --output-dir $(dirname {output.html:q}) 2>&1 | tee {log:q}"
