"""The base every layer stands on: errors, modes, argument axes, the batch descriptor,
how calls bind their arguments, and `Options`. Plain values and pure functions; nothing here
touches a device or imports another part of graphify."""
