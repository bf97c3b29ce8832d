"""Pipeline parallelism: schedules as tables, stage layout, and the executors."""
