"""Dashboards: queries that read the usage rollups and GPU samples, and plotly figure builders.

`queries` turns rollup rows into plain series (one aggregate query per chart, binned in Python
so the same code runs on PostgreSQL and SQLite); `figures` turns those series into plotly
figure JSON that the pages hand to plotly.js. Nothing here reads `UsageEvent`: at hundreds of
millions of requests only the rollups stay fast.
"""
