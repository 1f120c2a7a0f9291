"""Composable transforms over functions, used with `graphify` (for example `split`)."""
