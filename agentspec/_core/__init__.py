"""The drafting core: the native binding, trees, cursors, drafts, batches, speculators."""
