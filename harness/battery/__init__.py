"""The recipe battery, shipped inside the package so that an installed harness can check another project's recipe:

    pytest --pyargs harness.battery --recipe=theirpkg.module:attr
"""
