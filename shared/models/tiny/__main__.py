from shared.models.tiny.builder import main

main()
