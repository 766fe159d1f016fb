from coolsd.theory.sweep import main

main()
