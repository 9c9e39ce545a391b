"""Schedules: runs of an agent or a workflow started by beat at the slots of a cron expression
(in a time zone) or of a fixed interval, each slot fired exactly once.

The parts: when the slots are (`cron`, `cadence`), what a pass does with the slots that are due
and with a previous run still going (`policies`), what a user may ask for (`definition`), the
rows (`store`), and the pass itself (`firing`, beat's `tracon.schedules.fire`).
"""
