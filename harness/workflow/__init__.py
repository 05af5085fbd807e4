"""The workflow: the command line (``python -m harness``) and the report protocol with its renderers and figure.
The top layer: it may import every other one, and nothing imports it.
"""
