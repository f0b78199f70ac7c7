"""One module per `trainprobes` subcommand: add_arguments(parser) and run(args) -> exit code."""
