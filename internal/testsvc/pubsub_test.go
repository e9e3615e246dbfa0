package testsvc

import "testing"

func TestPubSubIsSharedAndAnswers(t *testing.T) {
	t.Parallel()
	a, b := PubSub(t), PubSub(t)
	if a != b {
		t.Fatalf("PubSub returned %q, then %q", a, b)
	}
	if err := HTTPReady(a); err != nil {
		t.Fatal(err)
	}
}
