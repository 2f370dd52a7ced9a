from flashnode.cli.main import main

main()
