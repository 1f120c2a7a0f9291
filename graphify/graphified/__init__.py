"""`graphify(fn, ...)` (`transform`) and the immutable callable it returns (`callable`), with
its stages and `check()`."""
