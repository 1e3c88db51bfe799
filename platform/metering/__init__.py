"""Usage metering: the crash-safe usage journal and its recovery (journal, ledger), the
batched event writer, the request hooks that admit and settle quotas, and usage
summaries and exports."""
