"""Limits on spend: the budget a run tree shares across workers and the cost quota of a tenant.

`budget_store` and `quota_store` hold the cluster-wide counters (Redis and in-memory); `tree`
is a run tree's budget as the executor asks it, `tenant_quotas` the tenants' quotas (their
limits in SQL, their counters in the store). Below `runs/` and `workflows/`, above
`coordination/` and `db/`.
"""
