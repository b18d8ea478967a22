"""memwall's writer: the only package that touches the file system or draws.

    reports.files     atomic writes with unique temp names; stale temp files cleaned
    reports.outputs   plan.json / results.json / trace.json / figures / sweep summary / console table
    reports.figures   matplotlib figures built from Results and traces (no I/O)
    reports.progress  progress bars on a terminal
    reports.profile_io  profile.json, the symbolic-profile cache, CAPTURE's JSONL run log

specs/ holds types and pure functions only; everything that writes lives here (STYLE.md).
"""
