"""The guards: host-device syncs and retained autograd graphs, found at the user's line.

- pure: `syncs` (which call syncs, whose line), `sync_watch` (the recorder), `sources` (the
  user's lines), `graphs` and `retained` (graphs kept between steps), `sampling` (budgets);
- Lightning: `base` (`Guard`), `sync_guard` (`SyncGuard`), `loss_logging_guard` (`LossLoggingGuard`).

Nothing is imported here, so importing a pure module does not import Lightning.
"""
