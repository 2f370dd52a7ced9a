from flashnode.cli import main

main()
