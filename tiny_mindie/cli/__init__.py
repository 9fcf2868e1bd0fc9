"""The commands of ``python -m tiny_mindie`` (``tiny-mindie``): :mod:`.main` parses the command
line and runs ``serve``, ``pull`` and ``list-models``; one module per other command (``chat``,
``certs``, ``health``, ``check-graph``). Empty, so that ``health`` starts without the server's
imports."""
