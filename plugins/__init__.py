"""Built-in drafters and verifiers of kangaroo (installed as ``kangaroo_plugins``)."""
