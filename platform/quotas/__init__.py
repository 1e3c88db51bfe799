"""Quotas: requests per minute, tokens per minute, concurrent requests and a token budget
per day or month, per tenant and optionally per API key.

Enforcement lives in the database, so every gateway process sharing it enforces ONE limit:

- Admission is one transaction: a single multi-row conditional upsert on
  `quota_counters` (`used = used + n WHERE used + n <= limit`, RETURNING the rows it
  changed) for every limit that applies, plus one lease row when the request holds
  something to give back (a concurrency slot, a token reservation). Any row missing from
  RETURNING means that limit is full: the transaction rolls back, nothing was taken.
  Tokens reserved = prompt tokens + max_tokens, against the budget and the token rate.
- Settlement is one transaction: delete the lease, then move each counter by
  (tokens actually used - tokens reserved) and give the concurrency slot back. A lease
  already gone means it was settled before (a retried settlement does nothing).
- A gateway that dies leaves live leases behind. Holders renew their leases every
  `lease_ttl / 3`; any replica's reaper marks expired ones `reaped` and gives their
  reservations back. If the request finishes after all, settlement finds `reaped` and
  charges the tokens actually used (the reservation is already back).
- Rows are always upserted in one sorted order, so concurrent transactions on PostgreSQL
  lock them in the same order and cannot deadlock each other.

Windows are fixed: the UTC minute for rpm/tpm (a burst straddling a minute boundary can
see up to twice the rate over those two minutes, never more than the limit within one),
the UTC day or calendar month for budgets. Reservations count in the window where they
were admitted. Replicas must have synchronized clocks (NTP), as they compute windows.

The limits themselves are read through a per-process cache (`QuotaCache`, TTL
`Settings.quotas.cache_ttl`, 5 s): a change made by the CLI or another replica applies
within that time. A tenant without limits costs no database work per request at all.

`hooks.QuotaHooks` is the gateway's side of this: a reservation at admission, its
settlement at finish (assembly/usage_hooks.py runs it beside metering).
"""
