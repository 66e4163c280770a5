"""Built-in stopping policies of kangaroo (installed as ``kangaroo_policies``)."""
