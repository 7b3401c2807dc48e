"""Acking: record ids (`ids`), the acker table on a numpy hash map (`u64map`, `acker`),
rotating timeouts (`rotating`) and the handlers sources and tasks wrap around user code
(`handlers`). Import the modules themselves: this package imports none of them, so an
executor that needs only the handlers loads neither the acker table nor the timeouts."""
