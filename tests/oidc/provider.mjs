// The OpenID provider the test suite signs in against: oidc-provider (an OpenID Certified
// implementation) with its built-in login and consent pages, static clients and a few accounts.
//
//   node provider.mjs CONFIG.json
//
// CONFIG: {"issuer", "port", "clients": [client metadata], "accounts": {login: claims},
//          "idTokenTtl": seconds, "conformIdTokenClaims": bool}
// Any password is accepted for a listed login; an unlisted login fails the sign-in. The accounts
// are read from CONFIG at each sign-in, so a test changes a person's claims by rewriting it.
// Prints "ready <issuer>" on stdout once it listens.
import { readFileSync } from "node:fs";
import Provider from "oidc-provider";

const read = () => JSON.parse(readFileSync(process.argv[2], "utf8"));
const config = read();

const provider = new Provider(config.issuer, {
  clients: config.clients,
  // PKCE on every authorisation request, whatever the client: a relying party without it fails.
  pkce: { required: () => true },
  // false: the scopes' claims go into the ID token too (most enterprise providers do so), so an
  // ID token alone names the user; true: they are only at the userinfo endpoint.
  conformIdTokenClaims: config.conformIdTokenClaims ?? false,
  claims: {
    openid: ["sub"],
    email: ["email", "email_verified"],
    profile: ["name"],
    groups: ["groups"],
    tenant: ["tenant"],
  },
  scopes: ["openid", "email", "profile", "groups", "tenant", "offline_access"],
  async findAccount(ctx, id) {
    const accounts = read().accounts;
    if (!Object.hasOwn(accounts, id)) return undefined;
    return { accountId: id, claims: async () => ({ sub: id, ...accounts[id] }) };
  },
  ttl: {
    IdToken: config.idTokenTtl ?? 3600,
    AccessToken: 3600,
    AuthorizationCode: 60,
    Interaction: 600,
    Session: 3600,
    Grant: 3600,
  },
  cookies: { keys: ["tandem-test-provider-cookie-key"] },
  features: { devInteractions: { enabled: true } },
});

provider.on("server_error", (ctx, err) => console.error("server_error", err));

const server = provider.listen(config.port, "127.0.0.1", () => {
  console.log(`ready ${config.issuer}`);
});

for (const signal of ["SIGTERM", "SIGINT"]) {
  process.on(signal, () => server.close(() => process.exit(0)));
}
