"""Test infrastructure: the pytest plugin, skip helpers decided at collection, hypothesis profiles. Imports the
battery and recipes it runs; the product layers below never import it.
"""
