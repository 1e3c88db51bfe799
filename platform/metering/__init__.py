"""Usage metering: the crash-safe usage journal and its recovery (journal, ledger), the
batched event writer, the request hooks that journal each request's usage with the quota
charges it holds (quotas are settled by their own hooks: assembly/usage_hooks.py composes
the two), and usage summaries and exports."""
