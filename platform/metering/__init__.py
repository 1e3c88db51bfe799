"""Usage metering: the batched event writer, the request hooks that admit and settle
quotas, and usage summaries and exports."""
