from shared.client.cli import main

raise SystemExit(main())
