"""The ``harness`` command line: one module per subcommand group."""
