from transformer_cli.cli import main

main()
