from flashnode.cli.main import main

main(prog_name="flashnode")  # the command an owner types, also when run as python -m flashnode
