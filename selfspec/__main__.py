from selfspec.cli import main

raise SystemExit(main())
