"""`epd-harness fuzz`: request shapes drawn against the baseline, failures grouped and shrunk.

Examples are drawn over what EPD depends on (`space`, `strategies`) and each is sent to the
baseline and the topology; the baseline's prompt ids give its exact layout against KV blocks
(`layout`), with what D and the storage already hold from the requests before it (`consumer`).
A failure is known when a declaration's verdict, evidence and trigger all hold (`known`,
`video_timing`), else new; failures are grouped by `signature`, and each group is shrunk
(`shrink`, through `oracles`) to a minimal request. `predictions` decides when a confirmed
crash trigger spares a send, `fault_effect` whether a planted fault acted, `run_budget` caps
the whole run; `records` holds what it came to, `bundle` writes it, and `save` declares a new
failure as a matrix scenario. `engine` (`FuzzEngine`) runs it all on real servers.
"""
