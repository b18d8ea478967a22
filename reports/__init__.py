"""memwall's writer: the only package that touches the file system or draws.

    reports.files     atomic writes with unique temp names; stale temp files cleaned
    reports.outputs   plan.json / results.json / trace.json / figures / console table / fit verdict
    reports.sweep     a multirun's summary.csv and summary.png
    reports.figure_base     byte units, colours, device ranges shared by the figures
    reports.figures_run     memory.png and timeline.png of one run (no I/O)
    reports.figures_compare compare.png and the prediction-error histograms (no I/O)
    reports.figures_sweep   a sweep's summary.png and MAP's time-vs-budget curve (no I/O)
    reports.progress  progress bars on a terminal
    reports.profile_io  profile.json, the symbolic-profile cache, CAPTURE's JSONL run log

specs/ holds types and pure functions only; everything that writes lives here (STYLE.md).
"""
