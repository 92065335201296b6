from transformer_cli.cli import main

if __name__ == "__main__":  # not when a server process of `tfm serve --workers` imports it
    main()
