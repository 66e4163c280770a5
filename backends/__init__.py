"""Built-in backends of kangaroo (installed as ``kangaroo_backends``)."""
