"""Metering read back: the dashboards' queries over the usage rollups and GPU samples, their plotly
figures and panels, the engine metric charts, and the health of what metering depends on.

`queries` turns rollup rows into plain series (one aggregate query per chart, binned in Python
so the same code runs on PostgreSQL and SQLite); `figures` turns those series into plotly
figure JSON that the pages hand to plotly.js. Nothing here reads `UsageEvent`: at hundreds of
millions of requests only the rollups stay fast.
"""
