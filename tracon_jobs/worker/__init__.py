"""The Celery-process plumbing: the app and its run task (`app`), the message of a run
(`envelope`), the Redis transport (`broker`), the broker of the settings, Redis or RabbitMQ
(`brokers`), the consumer that batches task events (`events`), the started thread pool
(`pool`) and the worker's graceful stop (`drain`).

Domain code never imports this package: `runs/` submits through the `Sender` it is given
(`runs.dispatch`), and the composition root (`tracon_jobs.runtime`) wires Celery to it.
"""
