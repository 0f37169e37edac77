"""Click commands of the `mq` console script (installed as the package ``mq.cli``)."""
