"""The scheduler: which requests run this step and how many tokens each computes (plain
data, no tensors), the KV block pool, lanes, tenant fairness and adapter memory."""
