"""Pure planning: capture sizes, the keys to capture, dispatch of a batch to a key, the
support policy, the immutable table of captured entries, pools and statistics. Plain data
and pure functions (a table holds its entries' device handles but never touches them)."""
