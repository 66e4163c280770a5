"""Measurement commands behind figures in the docs (``python -m kangaroo_apps.studies.NAME``): each takes the same
engine flags as ``kangaroo generate`` and writes what the docs quote."""
