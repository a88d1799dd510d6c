from aitrainsai.cli.command import main

main()
