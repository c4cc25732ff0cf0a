"""`tetrad plan --web`: a local page to look at plans (no torch, nothing fetched from the network).

The standard library's HTTP server (server.py) serves one page (page.html, page.js: the charts are
SVG drawn by the page's own script) and a small JSON API (api.py) over the planner's plan JSON,
the very object `tetrad plan --json` prints (tetrad.planner.report), with what the page draws
beside it: every pipeline stage's memory and the schedule's simulated timeline (details.py).
"""
