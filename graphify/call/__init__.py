"""One call's path below first use: its arguments checked, a graph dispatched, inputs
copied into static buffers, the replay, outputs handed out (`runtime`, `paths`)."""
