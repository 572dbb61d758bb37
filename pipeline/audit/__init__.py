"""The audit: settings, cases, the worker that runs cases to their rows, reductions, the driver, `audit()`."""
