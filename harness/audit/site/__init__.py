"""The folder the audit puts first on a launched script's ``PYTHONPATH``: its ``sitecustomize`` loads the audit in
every process of the script (:mod:`harness.audit.capture`)."""
