"""HTTP layer of the bundled server: request rewrite (chat), session API, errors, metrics."""
