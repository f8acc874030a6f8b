"""The fleet against the database: the memory plan and placement of instances on nodes and
GPUs, GPU accounting and charging, what-if fleet plans, and storing what NVML reports as `Gpu`
rows. The Django-free rules they apply are in `serving_app.placement`."""
