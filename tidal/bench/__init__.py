"""Benchmarks that compare speculation modes side by side: `tidal bench serve` (over HTTP,
`serve.run_sweep`) and `tidal bench offline` (in-process, `offline.run_offline_sweep`)."""
