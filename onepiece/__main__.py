from onepiece.cli import main

main()
